"""The ``kvpush`` command and what it launches: the CLI, a whole deployment on loopback
(``stack``), the demo, simulated engines, the embedded etcd, the tiny local model, and
how vLLM engines are started. Everything here imports downwards; nothing imports it
but tests and benchmarks."""
