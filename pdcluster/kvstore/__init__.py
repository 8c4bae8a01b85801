"""KV cache on disk that survives restarts: SGLang HiCache's `file` storage, one namespace per model and KV format.
SGLang names a page's file after its tokens and the served model name only, so the same name with other weights, dtype
or layout would read bytes that mean something else. Each worker's files therefore live in `<dir>/<fingerprint>/`,
where the fingerprint covers everything that decides a page's bytes (fingerprint.py); namespace.py keeps the
namespace's record, lock and cleanup; launch.py prepares a worker's namespace and then becomes SGLang; cli.py lists and
clears namespaces (`python -m pdcluster.kvstore list|clear`). It imports only common/.
"""
