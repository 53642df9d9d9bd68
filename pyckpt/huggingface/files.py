"""The file names of a Hugging Face model folder (transformers' constants), and the companion files
``from_pretrained`` reads beside the weights."""

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
# What from_pretrained reads beside the weights (model and generation configs, tokenizers): an export
# copies them when they lie beside the checkpoint, as the Trainer and save_pretrained leave them.
COMPANION_FILES = (CONFIG_NAME, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")
