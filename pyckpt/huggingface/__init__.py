"""Hugging Face's conventions for model folders: weight file names, the shard split and index of
``huggingface_hub``, and what ``from_pretrained`` expects beside the weights."""
