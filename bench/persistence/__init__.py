"""The KV persistence benchmark (`python -m bench.persistence`, `make bench-persistence`): a long prompt's TTFT cold,
from the KV store on disk, from memory and as a chat's next turn, on two clusters side by side that differ only in
pdcluster's CPU attention (cluster), and the numbers and targets drawn from it (report)."""
