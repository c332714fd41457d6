"""LoRA adapters on a frozen base model: the layers that add them, and their files (PEFT layout).

Shared by training (which updates adapters) and sampling (which serves them); imports neither.
"""
