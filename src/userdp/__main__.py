import sys

from userdp.cli import main

sys.exit(main())
