"""precast's version, in a module of its own: the package face (``precast.__version__``) and the layers below it
(the compile cache's key, the form cache, the LLM artifact's record) read it without importing the face."""

__version__ = "0.1.0"
