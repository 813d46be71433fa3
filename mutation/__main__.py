import sys

from mutation.runner import main

sys.exit(main())
