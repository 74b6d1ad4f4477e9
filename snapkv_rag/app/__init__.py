"""The Streamlit document-QA app (``snapkv-rag app``): :mod:`.page` is the script Streamlit runs,
the panels are :mod:`.sidebar`, :mod:`.documents`, :mod:`.answer` and :mod:`.views`, its options
:mod:`.config`, and :mod:`.cli` the command that starts it. Shipped in the wheel, so an installed
package starts the same app as a source checkout. Importing this package loads no Streamlit."""
