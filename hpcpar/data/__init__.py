"""Training data: the default corpus and batches, token file formats, tokenizers, `hpcpar data prepare`."""
