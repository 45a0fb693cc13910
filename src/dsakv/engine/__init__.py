"""Requests, scheduler (continuous batching), model runner and engine."""
