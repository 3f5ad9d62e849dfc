"""Stage 1: byte-exact vocabularies and the sub-token tables between two of them."""
