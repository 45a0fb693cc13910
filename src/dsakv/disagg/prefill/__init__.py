"""The prefill role: PrefillStage (worker), its pipeline leader / followers, the KV sender and prefix events."""
