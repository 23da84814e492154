"""The CLI side of ``python -m decode`` and its reports: the job
(``run``), prompts in and text out (``texts``), ``--compare`` (``compare``),
the statistics (``stats``) and the speedup theory they are compared with
(``theory``), the report's rows and config (``results``). The engine
(``decode.decoder`` and the modules beside it) never imports this package."""
