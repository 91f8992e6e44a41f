"""`octavo router`: one OpenAI-compatible endpoint in front of several `octavo serve` replicas."""
