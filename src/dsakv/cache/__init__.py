"""Page allocation and physical pools (device, host) and the prefix cache."""
