//go:build unix

package consumer

import (
	"io/fs"
	"syscall"
)

func idOf(fi fs.FileInfo) fileID {
	id := fileID{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.inode = uint64(st.Ino)
	}
	return id
}
