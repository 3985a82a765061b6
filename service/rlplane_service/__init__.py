"""rlplane_service: the rlplane service side (CLI, demo, benchmarks; the Ray Serve app to come)."""
