"""Disaggregated serving: five subpackages, each importing only the ones before it (tests/unit/test_layering.py).

    protocol/   what every role speaks: message dataclasses, the codec, RPC + auth, grants, wire forms, request
                lifecycles and ledgers, timeouts, the worker service, the page-hash chain of prefix routing
    transfer/   the KV transfer layer: manifest, handshake check (compat), transfer plan, staging, bootstrap,
                the transfer backends (mooncake, nixl, local)
    prefill/    the prefill worker: its pipeline leader and followers, the KV sender, prefix events
    decode/     the decode worker: inbound KV, outputs, its pipeline stages
    router/     the router (a serve Backend): peers, requests, dispatch, events, routing policy

prefill and decode never import each other; the router imports neither transfer nor the pipeline layer.
"""
