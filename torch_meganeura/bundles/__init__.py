"""Export: a deploy bundle (``export``) and a language model's generation bundle (``lm_export``), both
run by ``meganeura.runtime`` without torch.
"""
