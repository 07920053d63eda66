"""Many devices and processes: the mesh, where arrays live on it, and which
process this is and how it joins the run."""
