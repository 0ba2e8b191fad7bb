"""Graph passes, each a function over a Program: insert_casts, fold_constants, simplify_casts."""
