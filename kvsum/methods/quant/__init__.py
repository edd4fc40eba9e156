"""Quantization methods: every prompt token is kept, the budget is met by the bit width."""
