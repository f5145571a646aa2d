"""The KServe v2 REST routes, one group of Triton's API categories per module.

``pyserve.frontends.http.app.create_app`` puts the groups together in front of the Starlette
router; each group is a small class holding what its handlers need (the data plane, the body
cap) and listing its ``Route`` objects.
"""
