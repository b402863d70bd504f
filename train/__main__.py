import sys

print("python -m train: no training subcommand is implemented yet (see README 'Status').",
      file=sys.stderr)
sys.exit(2)
