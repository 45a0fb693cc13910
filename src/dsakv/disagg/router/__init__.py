"""The router: RouterBackend (backend) over peers, requests, dispatch, events and the routing policy."""
