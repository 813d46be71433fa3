"""The formal specification of dflash (``geometry.md``) in executable form, and its proofs."""
