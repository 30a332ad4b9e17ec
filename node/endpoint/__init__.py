"""The recording OpenAI-compatible endpoint: serve a model to any harness, record every call at token
level, take rewards, and hand the scored groups to the GRPO trainer (see DESIGN.md)."""
