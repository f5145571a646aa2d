"""Tools built on the server (load generator, Ray Serve deployment); nothing in the core imports them."""
