"""What the components (prefill/, decode/, router/, bootstrap/) share, in rooms by role: common/ (the protocol between
processes and what every process uses), worker/ (the launcher both worker roles run), kvstore/ (the KV cache on disk),
plugins/ (the SGLang plugins, loaded by SGLang itself) and local/ (the whole cluster on one machine). pyproject.toml's
import contracts keep the directions between them."""
