import sys

from hpcpar.cli.main import main

sys.exit(main())
