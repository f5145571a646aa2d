"""A model repository on disk, read into typed configuration: scanning, config.pbtxt, platforms,
the tensor checks a config implies, and `pyserve validate`."""
