"""The decode role: DecodeWorker, inbound KV, outputs and events, its pipeline stages (stage)."""
