import pathlib
import sys

# Test helpers (oracles.py) live beside the tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
