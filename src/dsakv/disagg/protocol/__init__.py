"""The control plane every disaggregated role shares: messages, codec, RPC, auth, grants, lifecycles, timeouts."""
