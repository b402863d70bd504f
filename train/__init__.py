"""`python -m train`: drafter and verifier-weight training for jspec.

Nothing trains yet; the subcommands (datagen, eagle3, dflash, diversed, d2sd) arrive with the
training work. Running `python -m train` says so and exits non-zero.
"""
