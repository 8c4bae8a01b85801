"""SGLang plugin: a decode notices that a prefill it knew was flipped (to decode and back) and connects anew.

Why: SGLang 0.5.23's decode caches, per prefill KV bootstrap address, where that prefill's KV manager listens (its
rank ip and port) and registers its own KV buffers with that manager once (`CommonKVReceiver._setup_bootstrap_infos`,
the `connection_pool`). A role flip tears the prefill's KV manager down and builds a new one, on a new port and
knowing no decode, while its KV bootstrap server (the same address) stays up, so SGLang's own heartbeat never drops
the cache. After a prefill -> decode -> prefill flip, every decode that had served with it sent its next request's
pre-allocation to the old port and waited out SGLang's 60 s KV timeout (seen in tests/e2e_flip: the router's canary
of the flipped-back prefill, and with several decodes a client's request).

What: with PDCLUSTER_FLIPPED_PREFILL=1 (the launcher sets it for every worker, on CPU and GPU alike: a role flip is
not a CPU matter), a cached entry older than REVALIDATE_AFTER seconds is checked against the prefill's bootstrap
server (the same `/route` query SGLang makes, at most once per REVALIDATE_AFTER per prefill and decode) before it is
used; an entry naming another rank address than the server's is dropped, and SGLang connects and registers anew as
for a prefill it never met. A flip cannot hide in that window: it starts only after the worker drained for
pdcluster/worker/role_flip.py's ROUTERS_FOLLOW (1 s) and found SGLang idle. The method is compared by a fingerprint
of its code: SGLang changing it stops the worker at start, naming it, rather than being wrapped unseen.
"""

from __future__ import annotations

import os

ENV_VAR = "PDCLUSTER_FLIPPED_PREFILL"


def register() -> None:
    """The `sglang.srt.plugins` entry point: nothing unless the variable is 1; a changed SGLang refuses to start
    (SystemExit: load_plugins() logs and swallows an Exception, and SGLang would start without the check)."""
    if os.environ.get(ENV_VAR) != "1":
        return
    from pdcluster.plugins.flipped_prefill import internals

    internals.apply()
