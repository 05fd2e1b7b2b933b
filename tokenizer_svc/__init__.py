"""Tokenizer service (`kvmesh tokenizer`): gRPC Tokenize and the streaming detokenizer."""
