"""Stage-split models and the data they train on."""
