"""`python -m sift.demo` (see the `sift.demo` docstring)."""

from sift.demo import main

if __name__ == "__main__":
    main()
