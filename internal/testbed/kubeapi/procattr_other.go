//go:build !linux

package kubeapi

import "syscall"

// procAttr puts a child in a process group of its own.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
