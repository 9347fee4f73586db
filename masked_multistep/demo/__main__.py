"""Entry point of ``python -m masked_multistep.demo``."""

from masked_multistep.demo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
