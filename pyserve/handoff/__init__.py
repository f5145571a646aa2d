"""Frontend processes and the hand-off to the model owner (``pyserve run --frontend-processes``).

``wire`` (the frames), ``owner`` (the owner's Unix-socket server), ``frontend`` (the frontend
process), ``http_proxy`` (relaying other HTTP routes), ``supervisor`` (starting and restarting
frontends), ``balancer`` (spreading new connections over the processes).
"""
