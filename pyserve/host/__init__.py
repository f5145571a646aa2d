"""The plugin host: backends found through entry points, called through typed hooks."""
