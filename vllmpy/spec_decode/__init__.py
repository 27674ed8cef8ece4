"""Speculative decoding: proposers that draft tokens and the verifier that keeps the output lossless."""
