"""The document-QA app, run from a source checkout: ``streamlit run apps/docqa/app.py -- --model PATH``.

The app itself ships inside the package (:mod:`snapkv_rag.app.page`); ``snapkv-rag app`` starts
the same page from an installed wheel. This file only runs it, so both start one app.
"""

import runpy

runpy.run_module("snapkv_rag.app.page", run_name="__main__")
