"""Stand-in package: merged with the wheel's files of the same package (sys.path order)."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
