"""The verdict rules: what counts as a divergence per dtype (fixed
tolerances, the low-precision noise floor). Pure data and arithmetic.

Layer: verdict. Imports nothing of harness."""
