"""Front-ends over the engine: the synchronous ``Runtime`` and the command line."""
