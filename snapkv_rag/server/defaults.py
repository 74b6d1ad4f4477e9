"""The server's defaults, for the command line and for :class:`~.app.ServerConfig`."""

# For requests that name no policy: the one default compression (snapkv_rag.compression.DEFAULT_COMPRESSION)
# by its spec name, so that parsing the command line loads no torch.
DEFAULT_COMPRESSION = "default"
DEFAULT_MAX_TOKENS = 1024  # for requests that give no max_tokens (the room in the context caps it too)
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a full 128K-token prompt is about 0.5 MB of text
# Completion requests admitted at once (waiting or generating); beyond it, 429 with Retry-After.
# The engine decodes at most max_batch_size of them together (16 on a CPU, 64 on a GPU); the rest wait for room.
DEFAULT_MAX_QUEUE = 64
# Seconds that generating requests get to finish at Ctrl+C or SIGTERM; `docker stop` kills after 10.
DEFAULT_SHUTDOWN_GRACE = 3.0
# Seconds a request's body may take to arrive; a slower client gets 408 (it never held a queue place).
DEFAULT_BODY_TIMEOUT = 30.0
