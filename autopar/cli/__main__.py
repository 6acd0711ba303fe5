"""``python -m autopar.cli ...`` runs the command line."""
import sys

from autopar.cli import main

sys.exit(main())
