//go:build !unix

package consumer

import "io/fs"

// No inode here: a rename shows in the size or the mtime.
func idOf(fi fs.FileInfo) fileID {
	return fileID{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
}
