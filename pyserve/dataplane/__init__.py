"""The one API every frontend calls: inference hand-off, response cache, shared memory, BLS,
classification, forwarded headers."""
