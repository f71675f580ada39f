"""Zero-code instrumentation: what `ettr run` loads into its Python children.

`ettr run` puts `bootstrap/pythonpath/` first on the children's PYTHONPATH; its `sitecustomize.py` decides
whether this process is a training process of the run and, if so, calls `ettr.bootstrap.start.start()`,
then chains any other `sitecustomize` on the path. `start` sets up the recorder (PROCESS_START), the
training-thread heartbeat, fault injection and, unless `--no-auto`, the torch hooks of `hooks` and
`checkpoint_hooks`, installed lazily when the script imports torch (`post_import`).
"""
