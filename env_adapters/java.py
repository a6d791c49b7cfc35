"""The Java runtime the JVM-backed games need (ScienceWorld, TextWorld-Express run as a JAR driven through py4j).

py4j starts ``java`` from ``PATH``. :func:`require_java` finds it (or ``$JAVA_HOME/bin/java``, which it then puts on
``PATH``) and otherwise raises a ``RuntimeError`` that says how to install one, instead of py4j's bare
``FileNotFoundError`` from deep inside the game's constructor.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["INSTALL_JAVA", "require_java"]

INSTALL_JAVA = ("install a Java runtime (Java 11 or newer) and put `java` on PATH (or set JAVA_HOME): "
                "Debian/Ubuntu: sudo apt-get install -y default-jre-headless; conda: conda install -c conda-forge "
                "openjdk=17; macOS: brew install openjdk@17")


def require_java(env: str) -> str:
    """The path of the ``java`` executable; a ``RuntimeError`` naming ``env`` and how to install Java if none."""
    found = shutil.which("java")
    if found:
        return found
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            os.environ["PATH"] = os.path.dirname(candidate) + os.pathsep + os.environ.get("PATH", "")
            return candidate
    raise RuntimeError(f"the {env!r} environment runs its game on the JVM, and no `java` was found on PATH or in "
                       f"JAVA_HOME; {INSTALL_JAVA}")
