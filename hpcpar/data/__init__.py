"""Training data: the default corpus and batches, token file formats, tokenizers, `hpcpar data prepare`;
and the rules for reading files from elsewhere (`untrusted`), which every reader above data/ applies too."""
